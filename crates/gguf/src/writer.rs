pub struct GgufWriter;
