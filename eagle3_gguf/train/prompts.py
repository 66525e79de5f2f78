"""Training prompts: our own topic lists × instruction templates, written for this project.

No benchmark text is used (MT-bench and HumanEval are what we measure on). Every prompt here is built
from the lists below by a seeded generator, so the set is reproducible and carries this project's
licence. Categories: coding (Python functions with docstrings), explanations, writing, math word
problems, reasoning, extraction and roleplay. The target writes the answers (see data.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SOURCE = ("eagle3_gguf.train.prompts: topic lists x instruction templates written for eagle3-gguf "
          "(seeded; no MT-bench or HumanEval text)")


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


CODE_TASKS = [
    "returns the n-th Fibonacci number", "checks whether a string is a palindrome, ignoring case and spaces",
    "counts the vowels in a string", "returns the largest element of a list without using max()",
    "reverses the words in a sentence", "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the original order", "computes the factorial of n iteratively",
    "returns the greatest common divisor of two integers", "checks whether a number is prime",
    "flattens a nested list of integers", "counts how often each word appears in a text",
    "converts a temperature from Celsius to Fahrenheit", "returns the second smallest number in a list",
    "checks whether two strings are anagrams", "computes the running sum of a list",
    "returns all even numbers from a list", "rotates a list to the right by k positions",
    "finds the index of a target value with binary search", "capitalizes the first letter of every word",
    "computes the average of a list of numbers, returning 0.0 for an empty list",
    "returns the longest common prefix of a list of strings", "converts a Roman numeral to an integer",
    "converts an integer to its binary representation as a string", "checks whether brackets in a string are balanced",
    "returns the transpose of a matrix given as a list of lists", "computes the dot product of two vectors",
    "splits a list into chunks of size n", "returns the product of all numbers in a list",
    "counts the number of digits in a positive integer", "checks whether a year is a leap year",
    "finds the most common character in a string", "returns the sum of the digits of an integer",
    "sorts a list of tuples by their second element", "returns the intersection of two lists without duplicates",
    "computes the median of a list of numbers", "checks whether a list is sorted in ascending order",
    "replaces every vowel in a string with an asterisk", "returns the n smallest elements of a list",
    "computes compound interest given principal, rate and years", "validates a simple email address",
    "returns the length of the longest word in a sentence", "groups words by their first letter in a dictionary",
    "computes the hamming distance between two equal-length strings", "returns the prime factors of an integer",
    "generates the first n rows of Pascal's triangle", "checks whether a number is a perfect square",
    "counts the islands of 1s in a grid given as a list of lists", "implements a simple stack class with push and pop",
    "returns the difference between the largest and smallest values in a list",
    "converts a snake_case string to camelCase", "finds all pairs in a list that sum to a target",
    "computes the area of a triangle from its three sides", "returns the characters that appear exactly once in a string",
    "truncates a string to n characters and adds an ellipsis", "computes the cumulative maximum of a list",
    "parses a 'key=value;key=value' string into a dictionary", "checks whether a string contains only digits",
    "returns the number of days between two dates given as strings", "interleaves two lists element by element",
]
CODE_TEMPLATES = [
    "Write a Python function that {task}. Include a docstring and a short example.",
    "Implement a Python function which {task}. Add a docstring and type hints.",
    "Complete this task in Python: write a function that {task}. Explain your approach briefly.",
    "Write a well-documented Python function that {task}, and then show two test cases for it.",
    "I need a Python helper that {task}. Please write it with a clear docstring.",
    "def solution(...):\n    \"\"\"A function that {task}.\"\"\"\n\nFill in the function body in Python.",
]

# Function stubs (name, parameters, what it returns): completed from a signature + docstring, the way a
# code-completion user prompts. Written for this project.
STUBS = [
    ("count_upper", "s: str", "the number of uppercase letters in s"),
    ("sum_odd", "nums: list[int]", "the sum of the odd numbers in nums"),
    ("word_lengths", "text: str", "a list with the length of every word in text"),
    ("is_sorted_desc", "xs: list[int]", "True if xs is sorted in descending order"),
    ("first_repeated", "s: str", "the first character that appears twice in s, or None"),
    ("clamp", "x: float, lo: float, hi: float", "x limited to the range [lo, hi]"),
    ("dedupe_sorted", "xs: list[int]", "the sorted list of the distinct values in xs"),
    ("char_histogram", "s: str", "a dict mapping each character of s to its count"),
    ("nth_prime", "n: int", "the n-th prime number (1-based)"),
    ("digits_reversed", "n: int", "the integer whose digits are those of n in reverse order"),
    ("pairwise_diffs", "xs: list[int]", "the differences between consecutive elements of xs"),
    ("longest_run", "xs: list[int]", "the length of the longest run of equal consecutive values"),
    ("to_title", "s: str", "s with the first letter of each word capitalized"),
    ("count_substring", "s: str, sub: str", "how many times sub occurs in s, overlaps included"),
    ("matrix_sum", "m: list[list[int]]", "the sum of all entries of the matrix m"),
    ("diagonal", "m: list[list[int]]", "the main diagonal of the square matrix m"),
    ("mean_std", "xs: list[float]", "a tuple with the mean and the standard deviation of xs"),
    ("only_letters", "s: str", "s with every character that is not a letter removed"),
    ("min_max", "xs: list[int]", "a tuple (smallest, largest) of xs, in one pass"),
    ("rle_encode", "s: str", "the run-length encoding of s, e.g. 'aaab' -> 'a3b1'"),
    ("rle_decode", "s: str", "the string encoded by a run-length encoding such as 'a3b1'"),
    ("bits_set", "n: int", "the number of 1 bits in the binary form of n"),
    ("next_power_of_two", "n: int", "the smallest power of two that is >= n"),
    ("kth_largest", "xs: list[int], k: int", "the k-th largest value in xs"),
    ("common_chars", "a: str, b: str", "the sorted characters that occur in both a and b"),
    ("safe_divide", "a: float, b: float", "a / b, or None when b is zero"),
    ("is_armstrong", "n: int", "True if n equals the sum of its digits each raised to the number of digits"),
    ("zip_dict", "keys: list[str], values: list[int]", "a dict pairing keys with values"),
    ("invert_dict", "d: dict[str, int]", "a dict mapping each value of d to the list of its keys"),
    ("running_average", "xs: list[float]", "the list of averages of the first 1, 2, ..., len(xs) values"),
    ("caesar_shift", "s: str, k: int", "s with every letter shifted k places in the alphabet"),
    ("is_isogram", "word: str", "True if no letter occurs more than once in word, ignoring case"),
    ("sum_of_squares", "n: int", "the sum of the squares of 1..n"),
    ("triangle_kind", "a: int, b: int, c: int", "'equilateral', 'isosceles', 'scalene' or 'invalid'"),
    ("last_word_length", "s: str", "the length of the last word in s"),
    ("balanced_split", "xs: list[int]", "True if xs can be split into two parts with equal sums"),
    ("count_primes_below", "n: int", "how many primes are smaller than n"),
    ("unique_paths", "rows: int, cols: int", "the number of right/down paths through a rows x cols grid"),
    ("move_zeros", "xs: list[int]", "xs with all zeros moved to the end, order otherwise kept"),
    ("max_subarray_sum", "xs: list[int]", "the largest sum of a contiguous non-empty slice of xs"),
    ("is_subsequence", "a: str, b: str", "True if a is a subsequence of b"),
    ("words_with_prefix", "words: list[str], prefix: str", "the words that start with prefix"),
    ("fizzbuzz", "n: int", "the list of FizzBuzz strings for 1..n"),
    ("gcd_list", "xs: list[int]", "the greatest common divisor of all numbers in xs"),
    ("lcm", "a: int, b: int", "the least common multiple of a and b"),
    ("mirror_string", "s: str", "s followed by its reverse"),
    ("strip_vowels", "s: str", "s without any vowels"),
    ("sum_nested", "xs: list", "the sum of all integers in an arbitrarily nested list"),
    ("closest_pair", "xs: list[float]", "the two values in xs that are closest to each other"),
    ("hex_to_int", "s: str", "the integer value of the hexadecimal string s"),
    ("count_words", "text: str", "the number of words in text"),
    ("alternate_case", "s: str", "s with letters alternating between upper and lower case"),
    ("majority_element", "xs: list[int]", "the value that occurs more than len(xs) // 2 times, or None"),
    ("chunk_string", "s: str, n: int", "s split into pieces of length n (the last may be shorter)"),
    ("parse_csv_line", "line: str", "the fields of one comma-separated line, stripped of spaces"),
    ("days_in_month", "year: int, month: int", "the number of days in the given month"),
    ("normalize", "xs: list[float]", "xs scaled so that its values sum to 1"),
    ("triangular_numbers", "n: int", "the first n triangular numbers"),
    ("has_duplicates", "xs: list", "True if any value occurs more than once in xs"),
    ("shortest_word", "text: str", "the shortest word in text"),
]
STUB_TEMPLATES = [
    'Complete the following Python function.\n\ndef {name}({params}):\n    """Return {doc}."""\n',
    'def {name}({params}):\n    """Return {doc}.\n\n    Write the body of this function.\n    """\n',
    'Implement {name}({params}) in Python. It should return {doc}. Add a few doctest examples.',
    'Write the Python function below and explain how it works.\n\ndef {name}({params}):\n    # return {doc}\n',
]

EXPLAIN_TOPICS = [
    "photosynthesis", "how vaccines work", "the water cycle", "inflation", "black holes", "the immune system",
    "how a CPU executes instructions", "supply and demand", "plate tectonics", "machine learning",
    "the French Revolution", "compound interest", "how the internet routes data", "climate change",
    "the theory of evolution", "how batteries store energy", "the stock market", "DNA replication",
    "the causes of the seasons", "how airplanes fly", "recursion in programming", "the greenhouse effect",
    "how a bill becomes a law", "the Pythagorean theorem", "blockchain", "how the heart pumps blood",
    "opportunity cost", "the Renaissance", "nuclear fission", "how search engines rank pages",
    "the difference between weather and climate", "sleep and why we need it", "how rainbows form",
    "public key cryptography", "the role of enzymes", "how a refrigerator works", "the Industrial Revolution",
    "probability", "how volcanoes erupt", "object-oriented programming", "the moon's phases",
    "how muscles grow", "the scientific method", "why the sky is blue", "how tides work", "neural networks",
    "the basics of nutrition", "gravity", "how memory works in the brain", "version control with git",
    "the Roman Empire", "renewable energy", "how a compiler works", "the placebo effect", "electric circuits",
]
EXPLAIN_TEMPLATES = [
    "Explain {topic} in simple terms.", "Can you explain {topic} to a ten-year-old?",
    "What is {topic}? Give a clear explanation with an example.", "Summarize the key ideas behind {topic}.",
    "Give me a short overview of {topic} in three paragraphs.", "What are the most common misconceptions about {topic}?",
    "Explain {topic} step by step.", "Why does {topic} matter? Answer in a few sentences.",
]

WRITE_SUBJECTS = [
    "a rainy afternoon in the city", "a lighthouse keeper", "the first day at a new job", "a lost dog finding home",
    "autumn in the mountains", "a robot learning to paint", "friendship", "a small bakery", "the ocean at night",
    "a train journey", "a garden in spring", "a time traveler", "a chess match", "moving to a new country",
    "a library after closing time", "a birthday surprise", "a storm at sea", "learning to ride a bike",
    "an old photograph", "a market in the morning", "the last day of summer", "a snowy village", "a space station",
    "a forgotten key", "a street musician", "a family recipe", "a mountain climb", "a quiet morning coffee",
]
WRITE_TEMPLATES = [
    "Write a short story about {s}.", "Write a poem about {s}.", "Write a haiku about {s}.",
    "Write a short blog post about {s}.", "Describe {s} in one vivid paragraph.",
    "Write the opening paragraph of a novel about {s}.", "Write a limerick about {s}.",
    "Write a short diary entry about {s}.",
]
WRITE_TASKS = [
    "Write a polite email to a colleague asking to reschedule a meeting to next week.",
    "Write a product description for a reusable water bottle.", "Write a thank-you note to a teacher.",
    "Write a short cover letter for a junior data analyst position.",
    "Write a complaint letter about a late delivery, keeping it polite.",
    "Write a short speech for a friend's wedding.", "Write an announcement for a community clean-up day.",
    "Write a persuasive paragraph on why people should read more books.",
    "Write a short review of a fictional restaurant called The Blue Spoon.",
    "Write a motivational message for students before exams.",
    "Write a short LinkedIn post announcing a new job.", "Write instructions for making a cup of tea.",
]

NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "pencils", "books", "marbles", "stickers", "cookies", "cards", "stamps", "coins", "shells"]

MATH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {item} does {a} have now?",
    "A shop sells {item} at ${x} each. {a} buys {y} of them and pays with a ${z}0 bill. How much change does {a} get?",
    "A train travels at {x} km/h for {y} hours and then at {z} km/h for 2 hours. How far does it travel in total?",
    "{a} reads {x} pages a day. The book has {y}0 pages. How many days will it take to finish the book?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} saves ${x} every week. How much will {a} have saved after {y} weeks, if {a} already had ${z}?",
    "There are {x} students in a class. {y} percent of them walk to school. How many students walk to school?",
    "{a} and {b} share {x}0 {item} in the ratio {y}:{z}. How many {item} does each get?",
    "A recipe needs {x} eggs for {y} people. How many eggs are needed for {z}0 people?",
    "The price of a jacket is ${x}0. It is discounted by {y} percent. What is the new price?",
    "{a} is {x} years old. {b} is {y} years older than {a}. In {z} years, what will the sum of their ages be?",
    "A tank holds {x}00 liters. It is filled at {y} liters per minute. How long does it take to fill it from empty?",
    "Solve for x: {x}x + {y} = {z}0. Show your steps.", "What is {x} percent of {y}0? Explain how you compute it.",
    "A car uses {x} liters of fuel per 100 km. How much fuel does it need for a {y}0 km trip?",
]

REASON_TEMPLATES = [
    "{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
    "If all {x}s are {y}s and some {y}s are red, can we conclude that some {x}s are red? Explain.",
    "{a}, {b} and {c} each have a different pet: a cat, a dog and a fish. {a} does not have the dog. {b} has the "
    "fish. Which pet does each person have?",
    "A farmer has {n} sheep. All but {m} run away. How many are left? Think carefully.",
    "What comes next in the sequence {s}? Explain the pattern.",
    "If it takes {n} machines {n} minutes to make {n} widgets, how long would {m}0 machines take to make {m}0 "
    "widgets?",
    "Is the following argument valid? 'If it rains, the street is wet. The street is wet. Therefore it rained.' "
    "Explain.",
    "{a} is older than {b}. {c} is younger than {b}. Is {a} older than {c}? Explain step by step.",
    "You have a {n}-liter jug and a {m}-liter jug. Explain whether you can measure exactly 1 liter of water.",
    "What are the pros and cons of {topic}? Give a balanced answer.",
]
REASON_WORDS = ["bloop", "razzie", "lazzle", "gorp", "fibble", "tronk"]
DEBATES = ["working from home", "electric cars", "social media for teenagers", "homework", "city life versus "
           "country life", "learning a second language early", "nuclear power", "online classes", "school uniforms"]

EXTRACT_TEMPLATES = [
    "Extract all the names and dates from this text: \"{text}\"",
    "From the following text, list the people mentioned and what each of them did: \"{text}\"",
    "Read this and answer in JSON with the keys 'who', 'where' and 'when': \"{text}\"",
    "Summarize this text in one sentence: \"{text}\"",
    "What is the main event in this text, and where did it happen? \"{text}\"",
]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Toronto", "Kyoto", "Lima", "Prague", "Cairo", "Seoul", "Dublin"]
EVENTS = ["opened a bakery", "won a chess tournament", "published a book", "started a robotics club",
          "ran a marathon", "launched a startup", "gave a lecture on history", "planted a community garden"]
MONTHS = ["January", "March", "May", "July", "September", "November"]

ROLES = ["a pirate captain", "a friendly librarian", "a medieval knight", "a travel guide in Rome", "a detective",
         "a chef at a busy restaurant", "an astronaut on the moon", "a fitness coach", "a wise old wizard",
         "a customer support agent", "a museum curator", "a park ranger", "a history teacher", "a sports commentator"]
ROLE_TASKS = [
    "Introduce yourself and describe your day.", "Give me advice on how to stay motivated.",
    "Tell me about the most exciting thing that happened to you.", "Explain what your job involves.",
    "Welcome me and tell me three things I should know.", "Answer my question: what should I do this weekend?",
]
ROLE_TEMPLATES = ["Pretend you are {role}. {task}", "You are {role}. Stay in character. {task}",
                  "Act as {role}. {task}"]


# Open prose: topics × request forms × audience/format. Written for chat data like people ask for it
# (stem, humanities, everyday life, work, writing), where the balanced mix's fixed pools run out.
PROSE_TOPICS = [
    "black holes", "the water cycle", "photosynthesis", "plate tectonics", "vaccines", "the immune system",
    "climate change", "ocean currents", "the human brain", "sleep", "nutrition", "gut bacteria", "DNA",
    "evolution by natural selection", "the speed of light", "quantum computers", "artificial intelligence",
    "machine learning", "the internet", "encryption", "open-source software", "smartphones", "electric cars",
    "solar panels", "wind turbines", "nuclear fusion", "batteries", "3D printing", "space exploration",
    "the Moon landing", "Mars", "satellites", "volcanoes", "earthquakes", "hurricanes", "rainforests", "deserts",
    "coral reefs", "bees and pollination", "recycling", "plastic pollution", "clean drinking water",
    "the printing press", "the Industrial Revolution", "ancient Egypt", "ancient Greece", "the Silk Road",
    "the Renaissance", "the French Revolution", "the Cold War", "the history of money", "democracy",
    "human rights", "the United Nations", "world trade", "inflation", "interest rates", "the stock market",
    "cryptocurrency", "small businesses", "marketing", "remote work", "job interviews", "negotiation",
    "public speaking", "time management", "leadership", "teamwork", "customer service", "personal budgeting",
    "saving for retirement", "buying a first home", "renting an apartment", "cooking at home", "baking bread",
    "coffee", "tea", "vegetarian diets", "running", "yoga", "strength training", "hiking", "cycling in cities",
    "learning to swim", "gardening", "keeping houseplants alive", "adopting a pet", "training a puppy",
    "raising children", "friendship", "loneliness", "stress", "meditation", "happiness", "habits", "motivation",
    "learning a new language", "studying for exams", "reading more books", "writing a novel", "poetry",
    "Shakespeare", "classical music", "jazz", "photography", "painting", "museums", "film making", "video games",
    "board games", "chess", "the Olympic Games", "football", "travel on a budget", "visiting Japan",
    "living abroad", "city planning", "public transport", "architecture", "bridges", "skyscrapers",
    "the history of flight", "trains", "the postal service", "libraries", "newspapers", "social media",
    "online privacy", "misinformation", "critical thinking", "philosophy", "ethics", "free will",
    "the scientific method", "statistics", "probability", "prime numbers", "geometry", "the number zero",
    "maps", "languages of the world", "writing systems", "mythology", "fairy tales", "volunteering",
    "moving to a new city", "starting a podcast", "running a meeting", "giving feedback", "burnout",
    "minimalism", "fashion", "sustainable clothing", "food waste", "farming", "fishing", "forests",
    "wildlife conservation", "zoos", "the seasons", "weather forecasts", "rainbows", "the night sky",
]
PROSE_FORMS = [
    "Explain {t}.", "Tell me about {t}.", "What should everyone know about {t}?", "Write a short essay about {t}.",
    "Write a blog post about {t}.", "What are the benefits and drawbacks of {t}?", "Give me five tips about {t}.",
    "Describe the history of {t}.", "How would you describe {t} to someone who has never heard of it?",
    "Why do people care about {t}?", "What are common mistakes people make with {t}?",
    "Write a persuasive paragraph about {t}.", "Compare {t} and {u}.", "How are {t} and {u} connected?",
    "Write a short story that involves {t}.", "Write a poem about {t}.", "Write a speech about {t}.",
    "Write an email to a friend about {t}.", "Create a lesson plan for teaching {t}.",
    "What questions would you ask an expert on {t}?", "Summarize the main debates about {t}.",
    "What is a surprising fact about {t}? Explain why it is true.", "Give an example that illustrates {t}.",
    "How might {t} change in the next twenty years?", "Write a dialogue between two people discussing {t}.",
    "What is the best way to get started with {t}?", "Write a product pitch inspired by {t}.",
    "List the key terms related to {t} and define each one.",
]
PROSE_STYLES = [
    "", "", "", "Keep it short.", "Use simple words.", "Answer in two paragraphs.", "Use a numbered list.",
    "Write it for a teenager.", "Write it for a beginner.", "Be concise but complete.", "Use a friendly tone.",
    "Use a formal tone.", "Include one concrete example.", "Answer in about 150 words.",
]


def _prose(rng: random.Random) -> str:
    t, u = rng.sample(PROSE_TOPICS, 2)
    style = rng.choice(PROSE_STYLES)
    text = rng.choice(PROSE_FORMS).format(t=t, u=u)
    return f"{text} {style}" if style else text


def _math(rng: random.Random) -> str:
    t = rng.choice(MATH_TEMPLATES)
    a, b = rng.sample(NAMES, 2)
    return t.format(a=a, b=b, item=rng.choice(ITEMS), x=rng.randint(2, 40), y=rng.randint(2, 12), z=rng.randint(1, 9))


def _reason(rng: random.Random) -> str:
    t = rng.choice(REASON_TEMPLATES)
    a, b, c = rng.sample(NAMES, 3)
    x, y = rng.sample(REASON_WORDS, 2)
    start, step = rng.randint(1, 9), rng.randint(2, 7)
    seq = ", ".join(str(start + step * i) for i in range(5)) if rng.random() < 0.5 else \
        ", ".join(str(start * 2 ** i) for i in range(5))
    n = rng.randint(5, 20)
    return t.format(a=a, b=b, c=c, x=x, y=y, n=n, m=rng.randint(2, n - 1), s=seq, topic=rng.choice(DEBATES))


def _stub(rng: random.Random) -> str:
    name, params, doc = rng.choice(STUBS)
    if rng.random() < 0.5:  # a variant without type hints
        params = ", ".join(p.split(":")[0] for p in params.split(", "))
    return rng.choice(STUB_TEMPLATES).format(name=name, params=params, doc=doc)


def _extract(rng: random.Random) -> str:
    people = rng.sample(NAMES, 2)
    text = (f"On {rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(1990, 2023)}, {people[0]} "
            f"{rng.choice(EVENTS)} in {rng.choice(CITIES)}. A week later {people[1]} {rng.choice(EVENTS)} there too.")
    return rng.choice(EXTRACT_TEMPLATES).format(text=text)


MIXES = ("balanced", "prose")


def source(mix: str = "balanced", seed: int = 0, chat: bool = True) -> str:
    """What a data manifest records as its prompts (the shipped head's data: SOURCE alone)."""
    text = SOURCE if (mix, seed) == ("balanced", 0) else f"{SOURCE}; mix {mix}, seed {seed}"
    return text if chat else f"{text}; raw text"


def build_prompts(n: int, seed: int = 0, mix: str = "balanced") -> list[Prompt]:
    """n prompts, categories interleaved (so any prefix of the list is a balanced sample). mix
    "balanced": every category (the shipped head's data); "prose": open prose requests only (_prose)."""
    if mix not in MIXES:
        raise ValueError(f"unknown prompt mix '{mix}' (one of: {', '.join(MIXES)})")
    rng = random.Random(seed)
    fixed = {
        "coding": [t.format(task=k) for k in CODE_TASKS for t in CODE_TEMPLATES],
        "explain": [t.format(topic=k) for k in EXPLAIN_TOPICS for t in EXPLAIN_TEMPLATES],
        "writing": [t.format(s=k) for k in WRITE_SUBJECTS for t in WRITE_TEMPLATES] + WRITE_TASKS,
        "roleplay": [t.format(role=r, task=k) for r in ROLES for k in ROLE_TASKS for t in ROLE_TEMPLATES],
    }
    for pool in fixed.values():
        rng.shuffle(pool)
    generated = {"math": _math, "reasoning": _reason, "extraction": _extract, "stub": _stub, "prose": _prose}
    order = ["prose"] if mix == "prose" else [
        "coding", "explain", "stub", "writing", "math", "coding", "explain", "reasoning", "stub", "roleplay",
        "extraction", "writing"]
    out: list[Prompt] = []
    seen: set[str] = set()
    cursor = {k: 0 for k in fixed}
    i = 0
    while len(out) < n:
        cat = order[i % len(order)]
        i += 1
        if cat in fixed:
            pool = fixed[cat]
            if cursor[cat] >= len(pool):
                continue
            text = pool[cursor[cat]]
            cursor[cat] += 1
        else:
            text = generated[cat](rng)
        if text in seen:
            if i > 50 * n:
                raise ValueError(f"only {len(out)} distinct prompts could be built")
            continue
        seen.add(text)
        out.append(Prompt(cat, text))
    return out
