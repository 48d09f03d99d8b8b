"""FLOPs and MFU accounting, remat policies, XLA flag presets, AOT compilation."""
