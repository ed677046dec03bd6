// Conversations and settings kept in this browser (localStorage), and their JSON export and
// import. An import never replaces a conversation: one whose id is already here gets a new id.

const CONVS = 'strata.conversations';
const SETTINGS = 'strata.settings';

export const DEFAULT_SETTINGS = {
  system: '',
  temperature: 0.8,
  top_p: 0.95,
  max_tokens: 1024,
  slop_mode: 0,
  slop_phrases: '',
  mtp_window: 0,
  /** Empty: a fresh seed each request. */
  seed: '',
};

export function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

export function loadConversations() {
  try {
    const v = JSON.parse(localStorage.getItem(CONVS) || '[]');
    return Array.isArray(v) ? v.filter((c) => validConversation(c) === null) : [];
  } catch (_) {
    return [];
  }
}

/** Throws (quota exceeded) so the caller can say so; nothing is dropped silently. */
export function saveConversations(convs) {
  localStorage.setItem(CONVS, JSON.stringify(convs));
}

export function loadSettings() {
  try {
    return { ...DEFAULT_SETTINGS, ...JSON.parse(localStorage.getItem(SETTINGS) || '{}') };
  } catch (_) {
    return { ...DEFAULT_SETTINGS };
  }
}

export function saveSettings(s) {
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

const ROLES = new Set(['system', 'user', 'assistant']);

/** null when `c` is a conversation this page can show, else what is wrong with it. */
export function validConversation(c) {
  if (!c || typeof c !== 'object') return 'not an object';
  if (typeof c.id !== 'string' || !c.id) return 'id: not a non-empty string';
  if (c.title !== undefined && typeof c.title !== 'string') return 'title: not a string';
  if (!Array.isArray(c.messages)) return 'messages: not an array';
  for (let i = 0; i < c.messages.length; i++) {
    const m = c.messages[i];
    if (!m || typeof m !== 'object') return `messages[${i}]: not an object`;
    if (!ROLES.has(m.role)) return `messages[${i}].role: expected system, user or assistant`;
    if (typeof m.content !== 'string') return `messages[${i}].content: not a string`;
    if (m.reasoning !== undefined && typeof m.reasoning !== 'string') {
      return `messages[${i}].reasoning: not a string`;
    }
  }
  return null;
}

export function exportJson(convs) {
  return JSON.stringify({ format: 'strata-conversations', version: 1, conversations: convs }, null, 2);
}

/**
 * Parses an export (or a bare array of conversations) and returns them with ids that do not
 * clash with `existing`; throws an Error naming the first thing wrong, importing nothing then.
 */
export function parseImport(text, existing) {
  let v;
  try {
    v = JSON.parse(text);
  } catch (e) {
    throw new Error(`not JSON: ${e.message}`);
  }
  const list = Array.isArray(v) ? v : v && v.conversations;
  if (!Array.isArray(list)) throw new Error('expected {"conversations": [...]} or an array');
  const taken = new Set(existing.map((c) => c.id));
  return list.map((c, i) => {
    const why = validConversation(c);
    if (why) throw new Error(`conversations[${i}]: ${why}`);
    const copy = {
      id: c.id,
      title: c.title || '',
      created: Number(c.created) || Date.now(),
      messages: c.messages.map((m) => ({ ...m })),
    };
    if (taken.has(copy.id)) copy.id = newId();
    taken.add(copy.id);
    return copy;
  });
}
