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

# A shared-prefix workload for prefix caching: one long system prompt, then distinct questions.
# At block size 32 the system prompt fills four blocks and part of a fifth.
PREFIX_SYSTEM_PROMPT = (
    "You are a patient teaching assistant for a course on serving large language models. "
    "Answer in plain English, in at most three sentences, and define every technical term the "
    "first time you use it. The course covers the key-value cache, which stores the keys and "
    "values of every earlier token so that each new token costs one step instead of a full "
    "recomputation; paged attention, which cuts that cache into fixed-size blocks found through "
    "a block table; prefix caching, which lets requests that start with the same tokens share "
    "those blocks; quantization of the cache to eight or four bits; and speculative decoding, "
    "in which a cheap draft proposes tokens that the large model verifies in one pass.\n\n"
)
PREFIX_QUESTIONS = [
    "Question: What is a block table?\nAnswer:",
    "Question: Why does the last prompt token always get recomputed?\nAnswer:",
    "Question: How does copy-on-write help parallel sampling?\nAnswer:",
    "Question: What limits the batch size during decoding?\nAnswer:",
]
