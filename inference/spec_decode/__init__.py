"""Speculative decoding's proposers: prompt lookup (n-gram), a paged draft model, and the adaptive draft length. The
verifier that keeps sampling exact is `inference.sampling.rejection`."""
