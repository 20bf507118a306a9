"""The driver's collection of one training step's groups from a rollout engine.

    rounds.py     synchronous rounds of generate + score until dynamic sampling holds N groups
    streaming.py  the same on a stream of groups, aborting the rest; partial rollout's carry (carry.py)
    scoring.py    what both share with the evaluation: rendered prompts, scoring a finished group
    seeds.py      every generation's sampling parameters and seed
    versions.py   which policy version made which tokens; staleness
    result.py     what a collector hands over, and its monitors
    pipeline.py   off-policy pipelining: the next step's collection in a background thread
"""
