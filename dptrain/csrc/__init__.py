"""The C, C++ and CUDA sources, and ``build``, which compiles the host libraries among them at first
use and caches them (ctypes loads them)."""
