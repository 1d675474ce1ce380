"""What several test modules share: the training harness, the workers that phalanx.spawn runs, the
CLI runner and the scripts tests launch. Test modules import from here, never from each other."""
