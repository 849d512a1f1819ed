"""The core: the driver seam, the device and its memory, compiling and launching, the arena layout,
staging and admission. Nothing here knows a kernel's meaning."""
