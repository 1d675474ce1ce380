"""``phalanx bench``: short runs of one training at 1..N devices through ``phalanx launch``, read
back from each run's per-step metrics into samples/s, scaling efficiency and a split of the step
time. Imports point down: cli -> bench -> harness -> launch."""
