"""Small helpers with no phalanx dependencies of their own: tensor trees, words, module lookup,
byte and time units, optimizer rebuilding."""
