"""Model architectures, one file each."""
