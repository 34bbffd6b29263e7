"""Distribution strategies, their context stack, cross-device ops and distributed values."""
