"""What goes into the model's prompt and what constrains its answer: chat templates (and the
sandbox they run in), tool calls rendered and parsed per family, and grammar masks."""
