"""A run in its workdir: the plan worked out once per launch (`plan.RunPlan`) and the record
the launcher keeps there (`record`: file names, revisions, history)."""
