"""Is the kernel right? Stage references, the plan's reference interpreter, stage-local and end-to-end checks."""
