"""The fixed word list that benchmark prompt text is drawn from (common English words)."""

# fmt: off
WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its",
    "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do",
    "could", "new", "about", "two", "first", "then", "also", "any", "like", "my", "now",
    "over", "such", "our", "man", "me", "even", "most", "made", "after", "many", "must",
    "years", "before", "through", "back", "where", "much", "your", "way", "well", "down",
    "should", "because", "each", "just", "those", "people", "how", "too", "little", "state",
    "good", "very", "make", "world", "still", "see", "own", "work", "long", "get", "here",
    "between", "both", "life", "being", "under", "never", "day", "same", "another", "know",
    "while", "last", "might", "great", "old", "year", "off", "come", "since", "against",
    "go", "came", "right", "used", "take", "three", "small", "house", "water", "light",
    "river", "city", "market", "garden", "road", "school", "music", "paper", "table", "stone",
    "bread", "winter", "summer", "morning", "evening", "window", "number", "family", "story",
    "answer", "question", "letter", "bridge", "forest", "island", "engine", "cloud", "field",
    "voice", "train", "ship", "horse", "village", "mountain", "ocean", "power", "system",
    "program", "order", "plan", "idea", "reason", "problem", "place", "group", "friend",
    "country", "company", "money", "night", "point", "fact", "hand", "head", "side", "part",
    "open", "close", "carry", "build", "write", "read", "learn", "teach", "bring", "keep",
    "hold", "turn", "start", "show", "hear", "play", "run", "move", "live", "believe",
)
# fmt: on
