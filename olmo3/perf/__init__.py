"""Performance tooling above training: ahead-of-time compilation, compiler flag sets."""
