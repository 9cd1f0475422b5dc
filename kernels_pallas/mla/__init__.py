"""Ragged paged MLA (DeepSeek-V2's latent attention): reference, Pallas GPU kernel, dispatcher."""
