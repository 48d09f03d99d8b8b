"""Experiments: no-argument Fiddle builders returning fdl.Config[Experiment].

Run one with `python launch/main.py --fdl_config=experiments.olmo3_7b:stage1`.
"""
