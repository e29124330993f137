"""C++ kernels for the CPU, compiled on first use against the installed torch."""
