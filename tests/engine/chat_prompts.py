"""100 short chat requests (10 tasks x 10 subjects) for the trained-weights agreement checks:
tests/engine/test_engine_gpu.py and bench/experiments/bf16_agreement.py use the same ones."""

SUBJECTS = ["the ocean", "a lighthouse keeper", "prime numbers", "the French revolution",
            "photosynthesis", "a lost cat", "the moon landing", "bread baking", "volcanoes",
            "a chess game"]  # fmt: skip
TASKS = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
         "Write a haiku about {}.", "What is the history of {}?", "Describe {} in one paragraph.",
         "Give me a quiz question about {}.", "Why do people care about {}?",
         "Summarize what you know about {}.", "Write a limerick about {}."]  # fmt: skip
CHAT_TEXTS = [t.format(s) for t in TASKS for s in SUBJECTS]
