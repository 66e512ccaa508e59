#include "common/safetensors_json.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardps::safetensors_internal {
namespace {

// Recursive descent over `text`; error positions are byte offsets into it.
class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<Json> Parse() {
    Json root;
    SHARDPS_RETURN_IF_ERROR(ParseValue(0, &root));
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected trailing characters");
    return root;
  }

 private:
  static constexpr int kMaxDepth = 32;

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed JSON header: ", what, " at byte ", pos_));
  }
  void SkipSpace() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
            text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  absl::Status ParseValue(int depth, Json* out) {
    if (depth > kMaxDepth) return Error("nesting too deep");
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end");
    switch (text_[pos_]) {
      case '{':
        return ParseObject(depth, out);
      case '[':
        return ParseArray(depth, out);
      case '"':
        out->type = Json::Type::kString;
        return ParseString(&out->string_value);
      case 't':
      case 'f':
      case 'n':
        return ParseLiteral(out);
      default:
        return ParseNumber(out);
    }
  }

  absl::Status ParseObject(int depth, Json* out) {
    out->type = Json::Type::kObject;
    ++pos_;  // '{'
    if (Consume('}')) return absl::OkStatus();
    do {
      SkipSpace();
      std::string key;
      SHARDPS_RETURN_IF_ERROR(ParseString(&key));
      if (!Consume(':')) return Error("expected ':'");
      out->members.emplace_back(std::move(key), Json());
      SHARDPS_RETURN_IF_ERROR(
          ParseValue(depth + 1, &out->members.back().second));
    } while (Consume(','));
    if (!Consume('}')) return Error("expected ',' or '}'");
    return absl::OkStatus();
  }

  absl::Status ParseArray(int depth, Json* out) {
    out->type = Json::Type::kArray;
    ++pos_;  // '['
    if (Consume(']')) return absl::OkStatus();
    do {
      out->items.emplace_back();
      SHARDPS_RETURN_IF_ERROR(ParseValue(depth + 1, &out->items.back()));
    } while (Consume(','));
    if (!Consume(']')) return Error("expected ',' or ']'");
    return absl::OkStatus();
  }

  absl::Status ParseHex4(uint32_t* out) {
    if (text_.size() - pos_ < 4) return Error("short \\u escape");
    *out = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      const int digit = c >= '0' && c <= '9'   ? c - '0'
                        : c >= 'a' && c <= 'f' ? c - 'a' + 10
                        : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                               : -1;
      if (digit < 0) return Error("bad hex digit in \\u escape");
      *out = *out * 16 + static_cast<uint32_t>(digit);
    }
    return absl::OkStatus();
  }

  absl::Status ParseUnicodeEscape(std::string* out) {
    uint32_t cp = 0;
    SHARDPS_RETURN_IF_ERROR(ParseHex4(&cp));
    if (cp >= 0xD800 && cp <= 0xDBFF) {  // high surrogate: a pair follows
      uint32_t low = 0;
      if (text_.substr(pos_, 2) != "\\u") return Error("lone surrogate");
      pos_ += 2;
      SHARDPS_RETURN_IF_ERROR(ParseHex4(&low));
      if (low < 0xDC00 || low > 0xDFFF) return Error("bad surrogate pair");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
      return Error("lone surrogate");
    }
    // UTF-8 encoding of the code point.
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    return absl::OkStatus();
  }

  absl::Status ParseString(std::string* out) {
    if (pos_ >= text_.size() || text_[pos_] != '"')
      return Error("expected '\"'");
    ++pos_;
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return absl::OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) {
        return Error("control character in string");
      }
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) break;
      // Escapes with a one-character meaning: \" \\ \/ \b \f \n \r \t.
      constexpr absl::string_view kEscaped = "\"\\/bfnrt";
      constexpr absl::string_view kMeaning = "\"\\/\b\f\n\r\t";
      const char e = text_[pos_++];
      if (const size_t k = kEscaped.find(e); k != absl::string_view::npos) {
        out->push_back(kMeaning[k]);
      } else if (e == 'u') {
        SHARDPS_RETURN_IF_ERROR(ParseUnicodeEscape(out));
      } else {
        return Error("bad escape");
      }
    }
    return Error("unterminated string");
  }

  absl::Status ParseLiteral(Json* out) {
    for (const absl::string_view word : {"true", "false", "null"}) {
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        out->type = word == "null" ? Json::Type::kNull : Json::Type::kBool;
        return absl::OkStatus();
      }
    }
    return Error("unexpected character");
  }

  // JSON number grammar; only plain non-negative integers keep their value,
  // which is all a safetensors header needs.
  absl::Status ParseNumber(Json* out) {
    out->type = Json::Type::kNumber;
    out->is_uint = true;
    if (pos_ < text_.size() && text_[pos_] == '-') {
      out->is_uint = false;
      ++pos_;
    }
    const size_t digits_begin = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      const uint64_t digit = static_cast<uint64_t>(text_[pos_++] - '0');
      if (out->uint_value > (UINT64_MAX - digit) / 10) out->is_uint = false;
      out->uint_value = out->uint_value * 10 + digit;
    }
    if (pos_ == digits_begin) return Error("unexpected character");
    const auto skip_digits = [this] {
      const size_t begin = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        ++pos_;
      }
      return pos_ > begin;
    };
    if (pos_ < text_.size() && text_[pos_] == '.') {
      out->is_uint = false;
      ++pos_;
      if (!skip_digits()) return Error("bad number");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      out->is_uint = false;
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) {
        ++pos_;
      }
      if (!skip_digits()) return Error("bad number");
    }
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<Json> ParseJson(absl::string_view text) {
  return JsonParser(text).Parse();
}

const Json* FindMember(const Json& object, absl::string_view key) {
  for (const auto& [name, value] : object.members) {
    if (name == key) return &value;
  }
  return nullptr;
}

}  // namespace shardps::safetensors_internal
