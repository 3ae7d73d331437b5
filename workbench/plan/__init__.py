"""Planning a cluster layout: analytic cost models (``layer_cost``: one GPT layer, op by op)."""
