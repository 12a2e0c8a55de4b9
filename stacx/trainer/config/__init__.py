"""The run's configuration data model: run config sections, algorithm config, the recipe model and its resolution."""
