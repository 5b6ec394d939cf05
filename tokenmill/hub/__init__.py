"""Model downloads: Hugging Face Hub and ModelScope, verified, with the seed's name forms."""
