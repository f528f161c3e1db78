"""Models: dettrain's LLaMA (llama.py), Hugging Face causal LMs (hf.py), your own model through Hydra (custom.py),
and which attention every model runs (attention.py)."""
