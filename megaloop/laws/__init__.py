"""Scaling-law fitters with bootstrap confidence intervals (`python -m megaloop laws fit`).

forms.py holds the laws as sums of positive terms, fit.py the robust fit (Huber on log loss, L-BFGS-B from many
random starts) and the bootstrap, testtime.py the comparison of the four test-time forms, isoflop.py the isoFLOP
parabolas and the power laws of the optimal loop count and token count, points.py the inputs (a CSV or run
directories) and cli.py the command.
"""
