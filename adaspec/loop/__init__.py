"""The decode loop and its maths: the controller (propose, verify, commit, account), the
judge and acceptance rules, sampling, per-step stats, and the plan a policy hands the loop."""
