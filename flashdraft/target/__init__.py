"""The target LLM: adapters with exact rollback, its head read from safetensors, linear attention, kernel parity.
Uses only the shared root modules (errors, files, safe_load, distributed)."""
