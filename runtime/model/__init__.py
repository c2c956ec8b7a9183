"""The models as a single device runs them: the reference every parallel run is compared against, its
dropout masks, Hugging Face weights in and out, and sampling."""
