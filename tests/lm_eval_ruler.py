"""lm-eval 0.4.13's RULER generators, run as lm-eval runs them, for tests/test_ruler.py to compare
olmo3's instances with: `python tests/lm_eval_ruler.py TOKENIZER_DIR SEED SAMPLES TASK:LENGTH ...`
prints one JSON line per instance (task, length, input, outputs, gen_prefix), the first SAMPLES
of each task's 500 at that length.

Each (task, length) is generated as lm-eval generates one task at one length in a fresh run:
Python's and NumPy's global generators seeded (`simple_evaluate`'s random.seed and
numpy.random.seed) just before, its module's own generator fresh (cwe_utils is reloaded). Only
the offline generators: the needle module loads NLTK's sentence model at import (for the essays,
not used here), so an empty stand-in directory is put where NLTK looks (no network here).
"""

import importlib
import json
import os
import random
import sys
import tempfile

import numpy as np

nltk_data = tempfile.mkdtemp()
os.makedirs(os.path.join(nltk_data, "tokenizers", "punkt_tab"))
os.environ["NLTK_DATA"] = nltk_data
os.environ["HF_HUB_OFFLINE"] = "1"

from lm_eval.tasks.ruler import cwe_utils, fwe_utils, niah_utils, vt_utils  # noqa: E402

GENERATORS = {"ruler_vt": lambda: vt_utils.get_vt_dataset,
              "ruler_cwe": lambda: importlib.reload(cwe_utils).get_cw_dataset,
              "ruler_fwe": lambda: fwe_utils.fwe_download}


def main() -> None:
  tokenizer, seed, samples, *wanted = sys.argv[1:]
  for spec in wanted:
    task, length = spec.split(":")
    make = (GENERATORS[task]() if task in GENERATORS else getattr(niah_utils, task))
    random.seed(int(seed))
    np.random.seed(int(seed))
    rows = make(tokenizer=tokenizer, max_seq_lengths=[int(length)])["test"]
    for row in list(rows)[:int(samples)]:
      print(json.dumps({"task": task, "length": int(length), "input": row["input"],
                        "outputs": list(row["outputs"]), "gen_prefix": row["gen_prefix"]}))


if __name__ == "__main__":
  main()
