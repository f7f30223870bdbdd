"""Single-process tests of pure code: no process group."""
