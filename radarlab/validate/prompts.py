"""The fixed prompts every validation check uses, so tests and the report compare the same things."""

VALIDATION_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
    "In 1969, the first humans",
]
