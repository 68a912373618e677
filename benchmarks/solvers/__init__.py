"""The solver's update: the rules against torch.optim on the digits demo (solvers_digits) and the update
kernels' bandwidth against a device copy of the same bytes (update_bandwidth)."""
