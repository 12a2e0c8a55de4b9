"""The plugin machinery every kind of plugin uses: finding the modules that register them
(`discovery`: the built-in kernels, `stacx/custom/`, `--custom-module` files, and shipping user modules
to Ray workers) and the one name -> entry `Registry` (duplicates refused, unknown names answered with
the close matches and the registered names).

Loss kernels, engine kinds, environments, tools, rewards, workloads, built-in tasks and recipes are each
a `Registry`. Standard library only: it is the ground floor every other package may build on.
"""
