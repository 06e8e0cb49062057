"""zerodp inside other people's training loops. Each integration imports its framework
only when it is imported itself, so the frameworks stay optional dependencies."""
