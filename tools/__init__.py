"""Developer tools that run beside q12drv (not part of the package): profilers and their readers."""
