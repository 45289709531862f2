"""Running a build on the GPU: launch, token streaming, the watchdog, errors."""
