"""The servers: what vLLM and SGLang do with a drafter as checked lines, export to them, the engine process and
its scripts. Uses the decoding, drafter and target wings."""
