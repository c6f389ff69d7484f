"""Small helpers every stage may use: byte units, pausing the garbage collector, folding repeated table rows."""
