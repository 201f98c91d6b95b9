// The front door's check on HTTP generate bodies, before Triton parses them: Triton 2.51's HTTP front end
// crashes (SIGSEGV, every model down) on a JSON body nested extremely deep (observed, not measured to a
// threshold), which fits in a few hundred kilobytes. A request body nested deeper than MAX_DEPTH is refused with 400 here; anything
// else is passed on unchanged to the @triton location.
var MAX_DEPTH = 32;

function nesting(text) {
    // One pass; a string is skipped with indexOf (a 13 MB base64 image costs next to nothing).
    var depth = 0, deepest = 0, i = 0, n = text.length;
    while (i < n) {
        var c = text.charCodeAt(i);
        if (c === 34) {  // "
            var j = i + 1;
            for (;;) {
                j = text.indexOf('"', j);
                if (j < 0) {
                    return deepest;  // unterminated: Triton refuses it
                }
                var k = j - 1, backslashes = 0;
                while (text.charCodeAt(k) === 92) {  // a quote after an odd number of \ is escaped
                    backslashes++;
                    k--;
                }
                if (backslashes % 2 === 0) {
                    break;
                }
                j++;
            }
            i = j + 1;
            continue;
        }
        if (c === 91 || c === 123) {  // [ {
            depth++;
            if (depth > deepest) {
                deepest = depth;
                if (deepest > MAX_DEPTH) {
                    return deepest;
                }
            }
        } else if (c === 93 || c === 125) {  // ] }
            depth--;
        }
        i++;
    }
    return deepest;
}

function check(r) {
    var body = r.requestText;
    if (body === undefined) {
        // Larger than client_body_buffer_size: it was written to a file and cannot be checked.
        r.return(413, '{"error":"request body too large for the front door"}\n');
        return;
    }
    if (nesting(body) > MAX_DEPTH) {
        r.return(400, '{"error":"request body nests JSON deeper than ' + MAX_DEPTH + ' levels"}\n');
        return;
    }
    r.internalRedirect('@triton');
}

export default {check};
