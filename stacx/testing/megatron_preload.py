"""Imported by the rank forkserver (`stacx.testing.distributed.RANK_PRELOAD_MODULES`): megatron-core,
through `import_megatron_core` (its import-time compilation deferred), so every forked rank has it."""

from stacx.parallel.megatron_import import import_megatron_core

import_megatron_core()
