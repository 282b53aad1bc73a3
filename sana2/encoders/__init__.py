"""Encoders the diffusion model is trained behind: captions (text_encoder.py) and pixels (autoencoder.py)."""
