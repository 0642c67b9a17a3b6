"""The files a model comes in and what cadence makes of them: GGUF and HF sources read under canonical names,
the weight store they are converted to, the weight providers that read it for a forward, and a vocabulary's
fingerprint."""
