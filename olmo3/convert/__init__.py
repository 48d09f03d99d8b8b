"""Hugging Face <-> Orbax conversion and the logit-parity checker (`python -m olmo3.convert`)."""
