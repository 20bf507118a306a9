"""Where rollout, reward, algo and actor meet: the run's state and life cycle (`state`), one step's
rollout and evaluation (`collect`), getting rows to the ranks (`distribute`), the colocation protocol
(`phases`) and the step's monitors as pure functions (`scalars`). `train.py` reads as the algorithm on top."""
