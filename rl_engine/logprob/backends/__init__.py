"""One folder per backend of the selected-token logprob; each exports its one description (description.py)."""
