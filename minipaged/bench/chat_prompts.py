"""Real chat requests for a real model: questions and instructions a person might send.

The demo, the throughput benchmark, the tests and the book send these to an
instruct model through its chat template. They were written for minipaged
(no data set is downloaded) and vary in length on purpose, from a
five-word question to a paragraph with a task at the end, so that a batch of
them has prompts of different sizes, as a real one does.
"""

from __future__ import annotations

CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level in Celsius?",
    "Name three primary colors.",
    "Who wrote the play Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "Translate 'good morning' into Spanish.",
    "What does a thermometer measure?",
    "Give me a synonym for the word 'happy'.",
    "What is 12 multiplied by 8?",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about the sea.",
    "List four fruits that are red.",
    "Explain what a noun is to a ten-year-old.",
    "What are the three states of matter?",
    "Suggest a name for a small bakery that sells bread and cakes.",
    "What is photosynthesis? Keep the answer short.",
    "Give me three tips for getting better sleep.",
    "Write one sentence that uses the word 'library'.",
    "What is the difference between weather and climate?",
    "How do I make a cup of tea?",
    "Describe a cat in three words.",
    "What is the main job of the heart in the human body?",
    "Write a short thank-you note to a teacher.",
    "Why do leaves change color in the autumn?",
    "What should I pack for a day at the beach?",
    "Explain in simple words what a computer program is.",
    "Give two reasons why people keep dogs as pets.",
    "Write a four-line poem about the moon.",
    "What is the opposite of 'ancient'?",
    "I have eggs, flour, milk and sugar. What could I cook with them?",
    "My plant's leaves are turning yellow. What might be wrong, and what can I do about it?",
    "I am going to visit Paris for two days. Which three places should I see first, and why?",
    ("A friend says that the Great Wall of China can be seen from the Moon with the naked eye. "
    "Is that true? Explain briefly."),
    "Write a short story, of about five sentences, about a robot who learns to paint.",
    ("I want to start running but I get tired after a few minutes. Give me a simple plan for "
    "my first two weeks."),
    ("Compare trains and planes for a 500 kilometre journey: which is better for the "
    "environment, and which is usually faster door to door?"),
    ("Summarize in one sentence: The city council met on Tuesday to discuss the new park. "
    "Residents asked for more trees, a playground and benches. The council agreed to "
    "plant fifty trees this spring and to build the playground next year."),
    ("Read this list of tasks and put them in a sensible order for a morning: eat breakfast, "
    "get dressed, brush teeth, wake up, leave for work, make coffee."),
    "Rewrite this sentence so that it is polite: 'Give me the report now.'",
    ("Here is a sentence with a mistake: 'She don't like apples.' Correct it and explain the "
    "mistake."),
    ("You are planning a birthday party for a seven-year-old who loves dinosaurs. Suggest a "
    "cake, two games and a small gift for the guests."),
    ("Explain the water cycle step by step, as you would to a class of young students, and "
    "end with one question they could answer to check that they understood."),
    ("Write an email to a neighbour asking them to water my plants while I am away for a "
    "week. Keep it friendly and short."),
    "What are the pros and cons of working from home? Give two of each.",
    "Tell me a fun fact about octopuses.",
    ("If a train leaves at 3 pm and the trip takes 2 hours and 30 minutes, when does it "
    "arrive?"),
    "Give me a recipe idea for a quick vegetarian dinner, with a list of ingredients.",
)
"""48 user messages, each the only message of one conversation."""


def chat_conversations(num: int) -> list[list[dict[str, str]]]:
    """``num`` one-message conversations, cycling through ``CHAT_PROMPTS`` in order."""
    return [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]
            for i in range(num)]
