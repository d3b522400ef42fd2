"""What the CPU tier admits: the admission filter (superseded branches, closed sessions) and request hints."""
