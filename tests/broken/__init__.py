"""Target modules that cannot be checked at all: each must give a one-line error and exit 2."""
