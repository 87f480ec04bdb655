"""Mixtures of experts: which experts each token goes to (`routing`) and the expert
feed-forward that reads only the chosen experts' rows (`ffn`)."""
