"""weft.runtime.scheduler.scheduler: the scheduler process: request intake, batch policy (prefill, decode, retraction), KV cache accounting, the loop."""
