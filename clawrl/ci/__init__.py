"""CI tooling: gpu_lock_exec (shares one machine's GPUs between jobs; standard library only)."""
