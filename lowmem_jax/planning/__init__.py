"""The budget planner: the search space inside an accuracy envelope, the search, the descent."""
