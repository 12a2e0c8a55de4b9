"""Agent episodes: environments, tools, in-process multi-turn episodes, external agents (commands
against the OpenAI-compatible endpoint) and the trajectories their recorded turns make. See docs/agents.md."""
